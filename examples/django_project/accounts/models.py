"""A balance per account, and the ledger of the payments applied to it."""

from django.db import models


class Balance(models.Model):
    account_id = models.BigIntegerField(primary_key=True)
    balance = models.BigIntegerField(default=0)


class Entry(models.Model):
    """One row per payment applied (no unique key: a payment applied twice shows twice)."""

    payment_id = models.TextField()
    account_id = models.BigIntegerField()
    amount = models.BigIntegerField()
