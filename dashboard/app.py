"""The kvscope dashboard, a Streamlit app: ``streamlit run dashboard/app.py -- --collector URL``.

``kvscope dashboard`` starts it. It reads only the collector's HTTP API, runs the
advisor once per refresh and presents its report on six pages.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run` puts this folder on sys.path, not the one holding the kvscope package
# (an install has it on sys.path already; a checkout has it beside this folder).
_ROOT = next(
    (
        str(p)
        for p in Path(__file__).absolute().parents
        if (p / "kvscope" / "__init__.py").is_file()
    ),
    None,
)
if _ROOT is not None and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from kvscope.dashboard._shell import settings, sidebar  # noqa: E402

st.set_page_config(page_title="kvscope", page_icon=":material/monitoring:", layout="wide")
settings()
PAGES = [
    st.Page(
        "_pages/overview.py",
        title="Fleet overview",
        icon=":material/dns:",
        url_path="overview",
        default=True,
    ),
    st.Page("_pages/engine.py", title="Engine detail", icon=":material/memory:", url_path="engine"),
    st.Page("_pages/plateau.py", title="Plateau", icon=":material/show_chart:", url_path="plateau"),
    st.Page("_pages/latency.py", title="Latency", icon=":material/timer:", url_path="latency"),
    st.Page(
        "_pages/recommendations.py",
        title="Recommendations",
        icon=":material/build:",
        url_path="recommendations",
    ),
    st.Page(
        "_pages/prefix.py",
        title="Prefix and routing",
        icon=":material/alt_route:",
        url_path="prefix",
    ),
]
page = st.navigation(PAGES)
sidebar()
page.run()
