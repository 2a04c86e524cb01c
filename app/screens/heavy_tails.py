"""A page of the dashboard (app/views.py)."""
from app.views import PAGES

PAGES["heavy_tails"][1]()
