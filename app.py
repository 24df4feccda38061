"""SpecLab's Streamlit entry point: the shared sidebar and st.navigation over pages/.

Run it with `streamlit run app.py` (binds to 127.0.0.1; see .streamlit/config.toml)."""
import streamlit as st

from pages.common import sidebar

st.set_page_config(page_title="SpecLab", page_icon=":material/speed:", layout="wide")

# One line per page; the first is the default.
PAGES = [
    st.Page("pages/live.py", title="Live decode", icon=":material/bolt:", default=True),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("pages/profile.py", title="Profile", icon=":material/timer:"),
    st.Page("pages/retrain.py", title="Replay & retrain", icon=":material/model_training:"),
    st.Page("pages/runs.py", title="Runs", icon=":material/table_chart:"),
    st.Page("pages/kv.py", title="KV & prefetch", icon=":material/memory:"),
    st.Page("pages/export.py", title="Export", icon=":material/download:"),
]

page = st.navigation(PAGES)
sidebar()
page.run()
