"""Clients of the HTTP API that ship with Encore: the command line (`python -m app`) and the demo."""
