# The test database is SQLite in memory: no NAME needed.
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3"}}
INSTALLED_APPS = ["shop"]
SECRET_KEY = "django_tests_secret_key"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
