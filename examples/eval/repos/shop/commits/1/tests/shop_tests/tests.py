from django.test import SimpleTestCase, TestCase

from shop.models import Product
from shop.money import format_cents


class FormatCentsTests(SimpleTestCase):
    def test_two_digit_cents(self):
        self.assertEqual(format_cents(1234), "12.34")

    def test_under_a_unit(self):
        """Less than one unit of money keeps its leading zero."""
        self.assertEqual(format_cents(99), "0.99")


class ProductTests(TestCase):
    def test_price_display(self):
        Product.objects.create(name="pen", price_cents=250)
        self.assertEqual(Product.objects.get(name="pen").price_display(), "2.50")

    def test_cheapest_first(self):
        Product.objects.create(name="book", price_cents=1250)
        Product.objects.create(name="pen", price_cents=250)
        names = [p.name for p in Product.objects.order_by("price_cents")]
        self.assertEqual(names, ["pen", "book"])
