"""A page of the dashboard (app/views.py)."""
from app.views import PAGES

PAGES["compare"][1]()
