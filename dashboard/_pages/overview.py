"""Fleet overview page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.overview import render

run_page(render, "Fleet overview", without_data=True)
