"""A page of the dashboard (app/views.py)."""
from app.views import PAGES

PAGES["sql_console"][1]()
