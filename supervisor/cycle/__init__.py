"""The daemon's cycle: claim, dispatch, attempt, record, and the loops beside it."""
