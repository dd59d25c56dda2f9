"""Deployment over the network with Flower (``pip install hyperfed[flower]``), one module per
concern:

- ``appconfig``: hyperfed's run-config keys, the experiment as run-config keys, which clients a
  node serves, the Flower app folder (no ``flwr``);
- ``records``: message types, the payload <-> record codec, the group message;
- ``node``: the ``ClientApp`` and the clients a node serves;
- ``server``: the ``ServerApp`` and the round driver's transport over Flower;
- ``flower``: the app's components (``hyperfed.deploy.flower:server_app`` / ``:client_app``);
- ``launch``: the processes of a loopback deployment (SuperLink + SuperNodes), which need
  ``flwr`` only in the processes it starts; ``supernode`` / ``clientapp``: those processes;
  ``secure``: TLS and SuperNode authentication material; ``cli``: ``hyperfed flower``.

The Flower runtime (``node``, ``server``) never imports the launcher. Importing ``hyperfed``
never imports ``flwr``.
"""
