"""Settings of the example project: one PostgreSQL database, named by DATABASE_URL."""

import os

from psycopg.conninfo import conninfo_to_dict

_DATABASE = conninfo_to_dict(os.environ.get("DATABASE_URL", "postgresql://localhost/ledger"))

SECRET_KEY = "example-only"  # an example: it protects nothing
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "dedupworker.django",  # handlers' ORM calls in the worker's transaction; manage.py dedupworker
    "accounts",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # with psycopg 3
        "NAME": _DATABASE.get("dbname", ""),
        "USER": _DATABASE.get("user", ""),
        "PASSWORD": _DATABASE.get("password", ""),
        "HOST": _DATABASE.get("host", ""),
        "PORT": _DATABASE.get("port", ""),
        # A worker's handler thread keeps its connection between messages (Django's default,
        # 0, would reconnect for every message); checked before reuse after an idle spell.
        "CONN_MAX_AGE": 600,
        "CONN_HEALTH_CHECKS": True,
    }
}
