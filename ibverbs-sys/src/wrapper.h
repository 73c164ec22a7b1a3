/* Headers bound by ibverbs-sys. */
#include <infiniband/verbs.h>
/* The `rdmacm` feature (build.rs defines IBVERBS_SYS_RDMACM): librdmacm too. */
#ifdef IBVERBS_SYS_RDMACM
#include <rdma/rdma_cma.h>
#endif
