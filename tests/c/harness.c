/* The shared part of the C tests (harness.h): check counters, worlds of
 * fake ranks, the export blob's fields, the launch arguments check. */
#include "harness.h"

int n_pass, n_fail;
const char *current_test = "";
int quiet_make_world;
int world_device_base;
unsigned char *scratch_in, *scratch_out;

void failed(const char *file, int line, const char *what) {
  n_fail++;
  fprintf(stderr, "%s:%d: [%s] FAILED: %s\n", file, line, current_test, what);
}

tpc_config config(int rank, int world_size) {
  tpc_config c;
  memset(&c, 0, sizeof c);
  c.rank = rank;
  c.world_size = world_size;
  c.device = rank;
  c.max_bytes = MAX_BYTES;
  c.packet_max_bytes = PACKET_MAX;
  c.timeout_ns = TIMEOUT_NS;
  return c;
}

tpc_entry *entry_of(uint64_t id) {
  tpc_registry_lock();
  tpc_entry *e = tpc_registry_find(id);
  tpc_registry_unlock();
  return e;
}

int make_world(world *w, int n, int connect) {
  memset(w, 0, sizeof *w);
  w->n = n;
  for (int r = 0; r < n; ++r) {
    tpc_config c = config(r, n);
    c.device = world_device_base + r;
    if (tpc_comm_create(&c, &w->comm[r]) != TPC_OK) {
      if (!quiet_make_world)
        fprintf(stderr, "make_world: create of rank %d failed: %s\n", r, tpc_comm_last_error(NULL));
      return 0;
    }
    w->comm_id[r] = tpc_comm_id(w->comm[r]);
    const tpc_entry *e = entry_of(w->comm_id[r]);
    if (!e) return 0;
    w->control[r] = e->control;
    w->chunk[r] = e->control_chunk;
    w->err_host[r] = e->record;
    w->err_device[r] = e->record_device;
    if (tpc_comm_export(w->comm[r], w->handle[r]) != TPC_OK) return 0;
    w->buf[r] = fake_handle_pointer(w->handle[r]);
  }
  if (!connect) return 1;
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p)
      if (p != r && tpc_comm_open_peer(w->comm[r], p, w->handle[p]) != TPC_OK) return 0;
    if (tpc_comm_ready(w->comm[r]) != TPC_OK) return 0;
  }
  return 1;
}

void destroy_world(world *w) {
  for (int r = 0; r < w->n; ++r) {
    CHECK_RC(NULL, tpc_comm_destroy(w->comm[r]), TPC_OK);
    w->comm[r] = NULL;
  }
}

void check_all_released(const char *file, int line) {
  const int ok = fake.live_device == 0 && fake.live_host == 0 && fake.live_opens == 0 &&
                 fake.device_allocs == fake.device_frees && fake.host_allocs == fake.host_frees &&
                 fake.ipc_opens == fake.ipc_closes && fake.bad_device_frees == 0 &&
                 fake.bad_host_frees == 0 && fake.bad_closes == 0;
  if (ok) {
    n_pass++;
    return;
  }
  char msg[512];
  snprintf(msg, sizeof msg,
           "not all released: device %d allocs / %d frees (live %d), host %d / %d (live %d), "
           "ipc %d opens / %d closes (live %d), bad frees %d device %d host, bad closes %d",
           fake.device_allocs, fake.device_frees, fake.live_device, fake.host_allocs,
           fake.host_frees, fake.live_host, fake.ipc_opens, fake.ipc_closes, fake.live_opens,
           fake.bad_device_frees, fake.bad_host_frees, fake.bad_closes);
  failed(file, line, msg);
}

void *blob_buffer(const unsigned char *blob) { return fake_handle_pointer(blob); }
void *blob_chunk(const unsigned char *blob) { return fake_handle_pointer(blob + BLOB_CHUNK_AT); }

uint64_t blob_offset(const unsigned char *blob) {
  uint64_t offset;
  memcpy(&offset, blob + BLOB_OFFSET_AT, sizeof offset);
  return offset;
}

void blob_set_offset(unsigned char *blob, uint64_t offset) {
  memcpy(blob + BLOB_OFFSET_AT, &offset, sizeof offset);
}

void check_args(const world *w, int rank, const void *in, void *out, size_t nbytes,
                size_t row_bytes, int dtype, int op, int algo, uint64_t poison) {
  const tpc_kernel_args *a = &fake.last_args;
  const tpc_layout l = tpc_layout_for(w->n, MAX_BYTES, PACKET_MAX);
  for (int p = 0; p < TPC_MAX_RANKS; ++p) CHECK_PTR(a->bufs[p], p < w->n ? w->buf[p] : NULL);
  CHECK_PTR(a->err, w->err_device[rank]); /* the device view, not the host one */
  CHECK(a->err != (void *)w->err_host[rank]);
  CHECK_PTR(a->control, w->control[rank]);
  /* every peer's control slot, as mapped here (the fake maps at the peer's
   * own address); none for this rank or past the world */
  for (int p = 0; p < TPC_MAX_RANKS; ++p)
    CHECK_PTR(a->peer_control[p], p < w->n && p != rank ? w->control[p] : NULL);
  CHECK_EQ(a->comm_id, (uint32_t)w->comm_id[rank]);
  CHECK_EQ(a->comm_id, w->control[rank]->alive); /* the open slot matches */
  CHECK_EQ(a->max_blocks, FAKE_MULTIPROCESSORS); /* the device's count, read at creation */
  CHECK_EQ(fake.last_algo, algo);
  CHECK_EQ(a->kind, tpc_kind_word(op, algo, dtype, row_bytes));
  CHECK_EQ(a->kind & 0xffu, (uint32_t)op);
  CHECK_EQ((a->kind >> 8) & 0xffu, (uint32_t)algo);
  CHECK_EQ(a->poison, poison);
  CHECK_EQ(a->poison_out, poison != 0);
  CHECK_EQ(a->out_bytes, op == TPC_OP_ALL_GATHER ? nbytes * (size_t)w->n : nbytes);
  CHECK_EQ(a->out_f32, 0);
  CHECK_PTR(a->in, in);
  CHECK_PTR(a->out, out);
  CHECK_EQ(a->nbytes, nbytes);
  CHECK_EQ(a->row_bytes, row_bytes);
  CHECK_EQ(a->timeout_ns, TIMEOUT_NS);
  CHECK_EQ(a->packet_off, l.packet_off);
  CHECK_EQ(a->packet_slot_bytes, l.packet_slot_bytes);
  CHECK_EQ(a->data_off, l.data_off);
  CHECK_EQ(a->data_bytes, l.data_bytes);
  CHECK_EQ(a->rank, rank);
  CHECK_EQ(a->world, w->n);
  CHECK_EQ(a->dtype, dtype);
  CHECK_EQ(a->op, op);
}
