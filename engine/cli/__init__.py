"""`python -m engine`: parsing and printing only (main.py); each command is one call into the
service layer, and `bench NAME` dispatches to bench/NAME.py by name (the only import by name).

May import: every engine layer, store, bench (dispatch only)."""
