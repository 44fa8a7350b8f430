"""Adapters: the outside systems Encore talks to (artifact stores, Redis connections, the Celery app, webhook
delivery, tracing, GPU readings). They know nothing of jobs' rules; the control plane uses them."""
