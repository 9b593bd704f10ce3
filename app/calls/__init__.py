"""Calls as a business keeps them: every door's conversation in one live-call list with the admin API over every
worker (live.py), each call's recording (recording.py) and its signed webhooks (webhooks.py)."""
