"""What every door shares: a session (a dialect over a transport: WebSocket, TCP), its one admission path, its
conversation with the engine, its bounded outbox, flood guard and config, the JSON wire and the error vocabulary,
wire audio, the link report, and a UDP socket for the doors that take datagrams."""
