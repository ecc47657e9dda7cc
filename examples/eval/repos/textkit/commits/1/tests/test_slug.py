import unittest

from textkit import slugify


class SlugifyTest(unittest.TestCase):
    def test_single_word(self):
        self.assertEqual(slugify("Hello"), "hello")

    def test_accents(self):
        self.assertEqual(slugify("Creme"), "creme")
