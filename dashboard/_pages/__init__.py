"""Page scripts run by ``st.navigation`` (see ``dashboard/app.py``)."""
