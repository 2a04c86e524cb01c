"""A page of the dashboard (app/views.py)."""
from app.views import PAGES

PAGES["batch_regime"][1]()
