/*
 * Real symbols for the function-like macros of <infiniband/verbs.h>.
 *
 * The `static inline` functions are wrapped by bindgen (wrap_static_fns, compiled from OUT_DIR);
 * the macros below have exported compatibility functions of the same name whose semantics differ
 * (ibv_query_port's takes the shorter pre-rdma-core struct), so each is wrapped here and bound to
 * its C name on the Rust side.
 */
#include <infiniband/verbs.h>

int ibverbs_sys_query_port(struct ibv_context *context, uint8_t port_num,
			   struct ibv_port_attr *port_attr)
{
	return ibv_query_port(context, port_num, port_attr);
}

struct ibv_mr *ibverbs_sys_reg_mr(struct ibv_pd *pd, void *addr, size_t length,
				  int access)
{
	return ibv_reg_mr(pd, addr, length, access);
}

struct ibv_mr *ibverbs_sys_reg_mr_iova(struct ibv_pd *pd, void *addr,
				       size_t length, uint64_t iova, int access)
{
	return ibv_reg_mr_iova(pd, addr, length, iova, access);
}
