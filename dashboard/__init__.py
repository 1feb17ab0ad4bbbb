"""kvscope dashboard: a Streamlit app over a kvscope collector's HTTP API.

``kvscope dashboard --collector URL`` starts it (:mod:`kvscope.cli.dashboard`). Each refresh
reads engines, 1-second windows and finished requests through
:class:`advisor.CollectorSource`, runs :func:`kvscope.advisor.analyze` once and presents the
report (:mod:`kvscope.dashboard.data`): fleet overview, engine detail, plateau,
recommendations, prefix and routing. It never opens the collector's store and never
recomputes a finding.

Importing this package imports only the standard library, so ``kvscope --help``
works without the ``dashboard`` extra; :mod:`kvscope.dashboard.data` needs the advisor's
dependencies and the app modules need Streamlit.
"""

from kvscope.dashboard.settings import DashboardSettings, SettingsError, parse_settings

__all__ = ["DashboardSettings", "SettingsError", "parse_settings"]
