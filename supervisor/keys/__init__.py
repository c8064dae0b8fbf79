"""Signing keys: the keyring in the database and each daemon's cache of it."""
