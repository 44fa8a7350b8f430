"""Clients of the HTTP API that ship with Encore: the command line (`encore`, `python -m app`: cli.py, on
http_client.py, following.py, reporters.py and downloads.py) and the demo. They import nothing of the server side."""
