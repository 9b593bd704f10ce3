"""Browser calls over WebRTC: the HTTP routes that take an SDP offer and serve the page (routes.py), one call's peer,
data channel and media carrying the Realtime dialect (call.py), and a Python aiortc client for tests and load
(client.py)."""
