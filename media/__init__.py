"""Audio plumbing with no network: PCM/G.711 codecs, resamplers, jitter buffer, framing, pacing, aiortc tracks."""
