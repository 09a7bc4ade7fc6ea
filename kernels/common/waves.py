"""Wave arithmetic of the persistent schedules, without the DSL: the kernels run it on Int32 values and the host
sizes launches and workspaces with the same functions on plain ints."""


def unsplit_cluster_tiles(cluster_tiles, num_clusters):
    """Cluster tiles of the full waves, run whole; the rest (fewer than ``num_clusters``, or all when
    there is less than one wave) are split. Plain ints on the host, Int32 in the kernel."""
    return (cluster_tiles // num_clusters) * num_clusters
