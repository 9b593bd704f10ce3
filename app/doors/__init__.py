"""The doors: one module or package per family of clients, each a dialect (and where needed a transport) on the
shared session machinery (app/sessions/). realtime/ (the OpenAI Realtime WebSocket dialect, its session.update, items
and client secrets), duplex.py (the native dialect), phone/ (the telephone bridges: Twilio, Telnyx, Vonage,
FreeSWITCH, Asterisk AudioSocket, on one `PhoneLine`), webrtc/ (browser calls: the routes, one call, and a Python
client), sip/ (SIP trunks with RTP: the user agent server and one call's media). docs/architecture.md says how to add
one: phone/freeswitch.py is the smallest to copy for a phone platform, duplex.py for a WebSocket dialect."""
