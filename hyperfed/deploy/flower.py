"""The Flower app's components: ``hyperfed.deploy.flower:server_app`` and
``hyperfed.deploy.flower:client_app`` (what an app folder's ``[tool.flwr.app.components]``
names, :func:`hyperfed.deploy.appconfig.write_app`), running any hyperfed algorithm.

The algorithm files are untouched: the server role and the client role exchange the same
payloads (dicts of named tensors) as in the simulator, serialized into Flower records (exact
round trip). A run is

1. ``query.join``  -> every node answers the partition ids it serves and each one's
   ``Client.join`` payload; nothing else about them. The server sends it messages for those
   clients only;
2. ``query.setup`` -> setup stages, for algorithms that have one (MH-pFedHNDD);
3. per round: ``train`` -> one message per sampled node holding its sampled clients' payloads
   (for MH-pFedHN each one's own theta_i), trained there as one engine group per architecture;
   ``Grid.send_and_receive`` with a timeout, carrying on with the replies that came back and
   passed ``Server.check_reply`` (decentralized methods: ``query.gossip`` relays each
   client's neighbours' payloads, mixed on its node);
4. every ``eval_every`` rounds and at the end: ``evaluate`` -> each client's personalized
   model on its own test split; the server writes ``metrics.jsonl`` / ``summary.md`` into the
   run directory as the simulator does.

The pieces, one concern each: :mod:`hyperfed.deploy.appconfig` (run-config keys, the experiment
as run-config keys, which clients a node serves, the app folder), :mod:`hyperfed.deploy.records`
(message types, the records codec, the group message every message is),
:mod:`hyperfed.deploy.node` (the ClientApp and the clients a node serves),
:mod:`hyperfed.deploy.server` (the ServerApp and the round driver's Flower transport), and
:mod:`hyperfed.deploy.launch` (the processes of a loopback deployment).
"""

from hyperfed.deploy.node import client_app
from hyperfed.deploy.server import server_app

__all__ = ["client_app", "server_app"]
