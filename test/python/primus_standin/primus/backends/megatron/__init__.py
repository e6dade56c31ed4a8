"""Stand-in of Primus for cegen tests (not Primus code)."""
