"""Latency page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.latency import render

run_page(render, "Latency")
