"""Turn a title into a URL slug."""

import re
import unicodedata


def _ascii(text):
    """Drop accents: "Crème" becomes "Creme"."""
    normal = unicodedata.normalize("NFKD", text)
    return normal.encode("ascii", "ignore").decode("ascii")


def slugify(title):
    """Lower-case ASCII words joined by single dashes: "Hello, World!" -> "hello-world"."""
    text = _ascii(title).lower()
    text = re.sub(r"[^a-z0-9]", "-", text)
    return text
