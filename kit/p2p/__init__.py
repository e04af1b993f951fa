"""kit.p2p: the peer-to-peer layer over websockets (torch-free).

Read in this order: ``identity`` (keys, PeerIDs) → ``wire`` (frames, pure) → ``handshake``
(pure) → ``mux`` (multiplexed streams and flow control, pure) → ``connection`` (the asyncio
driver of one connection) → ``channel`` (the handshake driver) → ``transport`` (the one file
that speaks ``websockets``: listening, dialing, HTTP routes, the takeover by ``websocket``) →
``relay``, ``reachability`` → ``admission`` (each channel's handshake), ``handlers`` (each
stream to its protocol's handler) → ``peer`` (the connection registry, ``PeerAPI``).
"""
