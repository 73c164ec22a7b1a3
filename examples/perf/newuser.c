/*
 * The program a new user ports to the crate (issue 46), in plain libibverbs: two RC queue pairs
 * of one device in one thread, connected to each other over the GID, one CQ per QP.
 *
 *   newuser lat N     N ping-pongs of 8-byte Sends (warm-up of N/10 excluded): A sends, B
 *                     polls its receive, re-posts it and sends back, A polls its send and
 *                     receive and re-posts, B polls its send. Each wait is a busy
 *                     ibv_poll_cq(cq, 1, &wc) until it returns 1.
 *   newuser bw N      N RDMA Writes of SIZE bytes (default 65536) from A into B with up to
 *                     WINDOW (default 16) outstanding, each completion polled one at a time.
 *
 * Environment: IBVERBS_TEST_DEVICE (default: the first device), IBVERBS_TEST_GID_INDEX
 * (default 1), SIZE, WINDOW. Prints one RESULT line, as examples/newuser.rs does.
 * SPIN=K (latency mode, a calibration, default 0) adds a loop of K steps of a volatile counter
 * (6 instructions each at -O2) to every round trip, after A's post: the latency that many
 * more user-space instructions cost in this guest.
 * TOUCH=K (latency mode, a calibration, default 0) reads one byte of each of K distinct pages
 * of a buffer at the same place instead: what touching more memory per round trip costs.
 * MEMCPY=K (latency mode, a calibration, default 0) makes K calls of libc's memcpy of 256 bytes
 * instead: what moving structures the size of the crate's requests costs.
 * EMPTY_POLLS=K (latency mode) polls A's empty CQ K times before the loop, untimed: under
 * callgrind, the difference to K=0 is the cost of K empty polls.
 *
 * Build: cc -O2 -o newuser_c examples/perf/newuser.c -libverbs
 */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

enum { SEND_ID = 1, RECV_ID = 2 };

struct side {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *smr, *rmr;
	char sbuf[8], rbuf[8];
};

static unsigned long long empty_polls;
static long spin, touch, copies;
static void *(*volatile copy_fn)(void *, const void *, size_t) = memcpy;
static char copy_src[256], copy_dst[256];
static volatile char *touch_buf;

static int cmp_double(const void *x, const void *y)
{
	double a = *(const double *)x, b = *(const double *)y;
	return (a > b) - (a < b);
}

/* The median of the `n` intervals between consecutive entries of `t` (n + 1 entries); sorts
 * them in place of the first n. */
static double median_interval(double *t, long n)
{
	for (long i = 0; i < n; i++)
		t[i] = t[i + 1] - t[i];
	qsort(t, n, sizeof *t, cmp_double);
	return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Busy-polls `cq` into a one-entry array until a completion comes. */
static void wait_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			DIE("ibv_poll_cq: %d", n);
		if (n == 1)
			break;
		empty_polls++;
	}
	if (wc->status != IBV_WC_SUCCESS)
		DIE("completion %llu: %s", (unsigned long long)wc->wr_id, ibv_wc_status_str(wc->status));
}

static void post_recv(struct side *s)
{
	struct ibv_sge sge = { (uintptr_t)s->rbuf, sizeof s->rbuf, s->rmr->lkey };
	struct ibv_recv_wr wr = { .wr_id = RECV_ID, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(s->qp, &wr, &bad))
		DIE("ibv_post_recv");
}

static void post_send(struct side *s)
{
	struct ibv_sge sge = { (uintptr_t)s->sbuf, sizeof s->sbuf, s->smr->lkey };
	struct ibv_send_wr wr = { .wr_id = SEND_ID, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
	if (ibv_post_send(s->qp, &wr, &bad))
		DIE("ibv_post_send");
}

/* Polls `n` completions of side `s`, re-posting the receive when it completes. */
static void reap(struct side *s, int n)
{
	struct ibv_wc wc;
	while (n--) {
		wait_one(s->cq, &wc);
		if (wc.wr_id == RECV_ID)
			post_recv(s);
	}
}

static void connect_qp(struct ibv_qp *qp, uint32_t dqpn, union ibv_gid *gid, int gid_index, enum ibv_mtu mtu)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		DIE("INIT");
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *gid;
	a.ah_attr.grh.sgid_index = gid_index;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		DIE("RTR");
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 6;
	a.rnr_retry = 7;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		DIE("RTS");
}

int main(int argc, char **argv)
{
	if (argc < 3)
		DIE("usage: %s lat|bw N", argv[0]);
	int bw = !strcmp(argv[1], "bw");
	long iters = atol(argv[2]);
	const char *name = getenv("IBVERBS_TEST_DEVICE");
	int gid_index = getenv("IBVERBS_TEST_GID_INDEX") ? atoi(getenv("IBVERBS_TEST_GID_INDEX")) : 1;
	size_t size = getenv("SIZE") ? strtoul(getenv("SIZE"), 0, 10) : 65536;
	int window = getenv("WINDOW") ? atoi(getenv("WINDOW")) : 16;
	spin = getenv("SPIN") ? atol(getenv("SPIN")) : 0;
	touch = getenv("TOUCH") ? atol(getenv("TOUCH")) : 0;
	copies = getenv("MEMCPY") ? atol(getenv("MEMCPY")) : 0;
	if (touch && !(touch_buf = calloc(touch, 4096)))
		DIE("TOUCH: calloc");
	for (long k = 0; k < touch; k++)
		touch_buf[k * 4096] = 1;

	int ndev;
	struct ibv_device **list = ibv_get_device_list(&ndev), *dev = NULL;
	for (int i = 0; list && i < ndev; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name)) {
			dev = list[i];
			break;
		}
	if (!dev)
		DIE("no device %s", name ? name : "");
	struct ibv_context *ctx = ibv_open_device(dev);
	if (!ctx)
		DIE("ibv_open_device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_port_attr port;
	union ibv_gid gid;
	if (!pd || ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, gid_index, &gid))
		DIE("pd/port/gid");

	struct side sides[2];
	memset(sides, 0, sizeof sides);
	for (int i = 0; i < 2; i++) {
		struct side *s = &sides[i];
		s->cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
		struct ibv_qp_init_attr qa = { .send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
					       .cap = { .max_send_wr = 16, .max_recv_wr = 16,
							.max_send_sge = 1, .max_recv_sge = 1 } };
		s->qp = s->cq ? ibv_create_qp(pd, &qa) : NULL;
		s->smr = ibv_reg_mr(pd, s->sbuf, sizeof s->sbuf, IBV_ACCESS_LOCAL_WRITE);
		s->rmr = ibv_reg_mr(pd, s->rbuf, sizeof s->rbuf, IBV_ACCESS_LOCAL_WRITE);
		if (!s->qp || !s->smr || !s->rmr)
			DIE("cq/qp/mr");
	}
	connect_qp(sides[0].qp, sides[1].qp->qp_num, &gid, gid_index, port.active_mtu);
	connect_qp(sides[1].qp, sides[0].qp->qp_num, &gid, gid_index, port.active_mtu);
	struct side *a = &sides[0], *b = &sides[1];

	if (!bw) {
		long empties = getenv("EMPTY_POLLS") ? atol(getenv("EMPTY_POLLS")) : 0;
		for (long k = 0; k < empties; k++) {
			struct ibv_wc wc;
			if (ibv_poll_cq(a->cq, 1, &wc) != 0)
				DIE("EMPTY_POLLS: the CQ is not empty");
		}
		post_recv(a);
		post_recv(b);
		long warm = iters / 10;
		double t0 = 0, *stamps = malloc((iters + 1) * sizeof *stamps);
		if (!stamps)
			DIE("malloc");
		for (long i = 0; i < warm + iters; i++) {
			if (i == warm) {
				empty_polls = 0;
				t0 = now();
			}
			if (i >= warm)
				stamps[i - warm] = now();
			post_send(a);
			for (volatile long k = 0; k < spin; k++)
				;
			for (long k = 0; k < touch; k++)
				(void)touch_buf[k * 4096];
			for (long k = 0; k < copies; k++)
				copy_fn(copy_dst, copy_src, sizeof copy_src);
			reap(b, 1); /* B's receive, re-posted */
			post_send(b);
			reap(a, 2); /* A's send and receive */
			reap(b, 1); /* B's send */
		}
		double t = now() - t0;
		stamps[iters] = t0 + t;
		printf("RESULT newuser lang=c%s mode=lat iters=%ld rtt_us=%.3f lat_us=%.3f med_us=%.3f empty_per_rtt=%.3f\n",
		       spin ? "+spin" : touch ? "+touch" : copies ? "+memcpy" : "", iters, t / iters * 1e6, t / iters / 2 * 1e6, median_interval(stamps, iters) / 2 * 1e6,
		       (double)empty_polls / iters);
	} else {
		char *src = aligned_alloc(4096, size), *dst = aligned_alloc(4096, size);
		memset(src, 1, size);
		struct ibv_mr *smr = ibv_reg_mr(pd, src, size, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_mr *dmr = ibv_reg_mr(pd, dst, size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		if (!smr || !dmr)
			DIE("bw mr");
		long warm = iters / 10, total = warm + iters, posted = 0, done = 0, chunk = 50;
		long nchunks = iters / chunk;
		double t0 = now(), *stamps = malloc((nchunks + 1) * sizeof *stamps);
		if (!stamps || nchunks < 1)
			DIE("malloc / too few writes (at least 50)");
		struct ibv_wc wc;
		while (done < total) {
			while (posted < total && posted - done < window) {
				struct ibv_sge sge = { (uintptr_t)src, (uint32_t)size, smr->lkey };
				struct ibv_send_wr wr = { .wr_id = (uint64_t)posted, .sg_list = &sge, .num_sge = 1,
							  .opcode = IBV_WR_RDMA_WRITE,
							  .send_flags = IBV_SEND_SIGNALED }, *bad;
				wr.wr.rdma.remote_addr = (uintptr_t)dst;
				wr.wr.rdma.rkey = dmr->rkey;
				if (ibv_post_send(a->qp, &wr, &bad))
					DIE("ibv_post_send");
				posted++;
			}
			wait_one(a->cq, &wc);
			if (++done == warm)
				t0 = now();
			if (done >= warm && (done - warm) % chunk == 0 && (done - warm) / chunk <= nchunks)
				stamps[(done - warm) / chunk] = now();
		}
		double t = now() - t0;
		/* The median chunk of 50 writes, as a rate. */
		double med = median_interval(stamps, nchunks);
		printf("RESULT newuser lang=c mode=bw iters=%ld size=%zu window=%d mb_s=%.1f med_mb_s=%.1f\n", iters, size,
		       window, (double)iters * size / t / 1e6, (double)chunk * size / med / 1e6);
	}
	return 0;
}
