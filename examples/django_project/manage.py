#!/usr/bin/env python
"""Django's command line for the example project: `python manage.py migrate`, then
`python manage.py dedupworker run accounts.handlers:ApplyPayment --queue payments`."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ledger_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
