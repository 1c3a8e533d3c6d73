"""Scaling out: `llamax serve --replicas N` as Ray Serve replicas of the Engine behind one endpoint.

Needs the ray extra: `pip install "llamax[ray]"`.

    routing.py   which replica a request goes to (prefix-aware with a load bound, or round robin):
                 pure policy, no Ray
    router.py    that policy as Ray Serve's RequestRouter of the engine deployment
    replica.py   one replica: a model, its Engine, its stream of messages to the front end
    front.py     the front end: llamax.server's HTTP app over the replica set; build_app
    run.py       start (or join) Ray, run the application, stop on SIGINT / SIGTERM
"""
