"""`WS /v1/realtime`: the OpenAI Realtime vocabulary over one duplex conversation (dialect.py), its `session.update`
read field by field (update.py), its conversation items (items.py), and the ephemeral client secrets that let a
browser open a session without the server's key (client_secrets.py). WebRTC calls speak the same dialect
(app/doors/webrtc/)."""
