"""Helpers shared by the tests: checkpoints they write, servers they start, clients they drive."""
