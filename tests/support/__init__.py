"""Helpers shared by the tests and the fault bench (bench/faults.py): real parts, no fixtures.

- processes: the repository's paths, free ports, `wait_until` (poll with a deadline), redis-server processes;
- stack: `Stack`, a deployment-like set of Redis database, worker subprocesses and web app, plus the unit tests'
  services and Celery settings on the test redis-server;
- faults: the fault scenarios of the track lifecycle, written once for tests/test_reliability.py and the bench;
- models: tiny lip-sync weights and a music backbone that ends songs on cue;
- media: clips and sounds made with real ffmpeg from a real photograph;
- cli: the command-line client run as a user runs it.

Fixtures stay in tests/conftest.py; they build on these modules.
"""
