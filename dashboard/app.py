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
        "pages/overview.py",
        title="Fleet overview",
        icon=":material/dns:",
        url_path="overview",
        default=True,
    ),
    st.Page("pages/engine.py", title="Engine detail", icon=":material/memory:", url_path="engine"),
    st.Page("pages/plateau.py", title="Plateau", icon=":material/show_chart:", url_path="plateau"),
    st.Page("pages/latency.py", title="Latency", icon=":material/timer:", url_path="latency"),
    st.Page(
        "pages/recommendations.py",
        title="Recommendations",
        icon=":material/build:",
        url_path="recommendations",
    ),
    st.Page(
        "pages/prefix.py",
        title="Prefix and routing",
        icon=":material/alt_route:",
        url_path="prefix",
    ),
]
page = st.navigation(PAGES)
sidebar()
page.run()
