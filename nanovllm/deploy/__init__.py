"""Deployment beyond one process (chapter 17): the container image and Kubernetes objects
(``Dockerfile``, ``k8s/``, read by ``manifests``), a prefix-aware router over engine replicas
(``router``), replicas behind one endpoint with Ray Serve (``ray_serve``), and how many
replicas a day of traffic needs (``capacity``)."""
