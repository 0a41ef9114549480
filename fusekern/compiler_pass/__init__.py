"""The dynamo backend and the inductor passes that run fusekern's patterns."""
