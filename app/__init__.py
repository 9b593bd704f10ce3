"""The server, grouped by role (docs/architecture.md walks a frame through it):

- `shell/`: the server around the doors: settings and the model's choice, the aiohttp app and its routes
  (server.py), the processes (one engine per GPU, N workers), the shared context, auth, metrics, probes.
- `sessions/`: what every door shares: a session (a dialect over a transport), its one admission path, its
  conversation with the engine, outbox, flood guard, config, the JSON wire, errors, wire audio, the link report.
- `doors/`: one module or package per family of clients: realtime/, duplex.py, phone/, webrtc/, sip/.
- `calls/`: what follows every call: the live-call list and the admin API, recordings, webhooks.

Imports go app -> media, model; never back.
"""
