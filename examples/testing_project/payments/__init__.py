"""A payments service: one handler keeps a balance per account."""
