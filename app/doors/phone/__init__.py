"""The telephone bridges: what every one shares (line.py: `PhoneLine`, the call's start, audio in and out on the
pacer, DTMF, failures) and one module per platform: Twilio Media Streams, Telnyx, Vonage, FreeSWITCH
`mod_audio_stream` (WebSocket doors) and Asterisk AudioSocket (a TCP door); reorder.py puts numbered chunks back in
order for the platforms that may shuffle them."""
