"""The aiohttp server: CLI and settings, routes, WebRTC signalling, WebSocket dialects, sessions, auth, metrics."""
