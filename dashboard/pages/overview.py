"""Fleet overview page."""

from dashboard._shell import run_page
from dashboard._views.overview import render

run_page(render, "Fleet overview")
