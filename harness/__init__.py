"""The harness the tests and the benches share (bench/faults.py runs the fault scenarios with it): real parts, no
fixtures. It lives beside tests/, not in it, so that a bench needs nothing of the test suite.

- processes: the repository's paths, free ports, `wait_until` (poll with a deadline), redis-server processes;
- stack: `Stack`, a deployment-like set of Redis database, worker subprocesses and web app, plus the unit tests'
  services and Celery settings on the test redis-server;
- faults: the fault scenarios of the track lifecycle, written once for tests/test_reliability.py and the bench;
- models: tiny lip-sync weights and a music backbone that ends songs on cue;
- media: clips and sounds made with real ffmpeg from a real photograph;
- cli: the command-line client run as a user runs it.

Fixtures stay in tests/conftest.py; they build on these modules.
"""
