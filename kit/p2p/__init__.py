"""kit.p2p: the peer-to-peer layer over websockets (torch-free).

Read in this order: ``identity`` (keys, PeerIDs) → ``wire`` (frames, pure) → ``handshake``
(pure) → ``mux`` (multiplexed streams and flow control, pure) → ``connection`` (the asyncio
driver of one connection) → ``peer`` (listening, dialing, handlers) → ``relay``.
"""
