"""A page of the dashboard (app/views.py)."""
from app.views import PAGES

PAGES["growth"][1]()
