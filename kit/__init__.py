"""kit: train one large model together over the Internet, on donated GPUs.

Map of the package (data flows down this list; each room imports only rooms above it):

    errors.py        the one exception tree (whose fault? transient or permanent?)
    runtime.py       the one asyncio loop in one background thread + blocking facade
    p2p/             websocket peer-to-peer layer: identity, wire format, handshake,
                     multiplexed streams, relays for peers behind NAT
    dht/             Kademlia DHT with hivemind's store/get semantics
    averaging/       butterfly all-reduce, load-balancing LP, compression codecs
    data/            streaming tokenization pipeline, ALBERT MLM+SOP examples, tokenizer recipe
    cli.py           the ``kit`` command

Importing kit does nothing global: no threads, no logging configuration, no network.
"""

__version__ = "0.1.0"
