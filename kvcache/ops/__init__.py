"""What an operator's request does to a cache, shared by the offline CLI and live mode (DESIGN §2, §7): `requests`
(the requests and their results, values that are also the admin socket's wire format), `handlers` (`execute`: what
each request does) and `warm` (a namespace's hottest stored prefixes, L3 -> L2). Nothing here imports live mode:
the socket, its framing and its threads sit above, in `kvcache.live`, and call in."""
