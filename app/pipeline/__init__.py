"""Model and media code for Encore's pipelines. No Celery imports here: every stage is testable alone."""
