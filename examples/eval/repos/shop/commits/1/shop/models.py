from django.db import models

from shop.money import format_cents


class Product(models.Model):
    name = models.CharField(max_length=100, unique=True)
    price_cents = models.PositiveIntegerField()

    def __str__(self):
        return f"{self.name} ({self.price_display()})"

    def price_display(self):
        return format_cents(self.price_cents)
