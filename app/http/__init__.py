"""The HTTP layer: blueprints, the Khala contract, request schemas, uploads, event streams, rate limits."""
