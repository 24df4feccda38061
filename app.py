"""SpecLab's Streamlit entry point: the shared sidebar and st.navigation over views/.

Run it with `streamlit run app.py` (binds to 127.0.0.1; see .streamlit/config.toml)."""
import streamlit as st

from views.common import sidebar

st.set_page_config(page_title="SpecLab", page_icon=":material/speed:", layout="wide")

# One line per page; the first is the default.
PAGES = [
    st.Page("views/live.py", title="Live decode", icon=":material/bolt:", default=True),
    st.Page("views/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("views/profile.py", title="Profile", icon=":material/timer:"),
    st.Page("views/retrain.py", title="Replay & retrain", icon=":material/model_training:"),
    st.Page("views/runs.py", title="Runs", icon=":material/table_chart:"),
    st.Page("views/kv.py", title="KV & prefetch", icon=":material/memory:"),
    st.Page("views/export.py", title="Export", icon=":material/download:"),
]

page = st.navigation(PAGES)
sidebar()
page.run()
